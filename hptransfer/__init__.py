"""hptransfer: tune small, train large - hyper-parameter transfer sweeps for transformers."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy, so `import hptransfer.models` does not pull in httpx/pandas
    if name in ("Client", "ApiError"):
        from . import client

        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["ApiError", "Client", "__version__"]
