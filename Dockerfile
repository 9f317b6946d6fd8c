FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY hptransfer ./hptransfer
COPY examples ./examples
RUN pip install --no-cache-dir "torch>=2.4,<2.14" && pip install --no-cache-dir -e .
EXPOSE 8600
CMD ["hpt", "serve", "--host", "0.0.0.0"]
