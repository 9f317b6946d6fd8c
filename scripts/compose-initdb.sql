-- separate databases: app, Optuna and MLflow all use an alembic_version table
CREATE DATABASE optuna OWNER hpt;
CREATE DATABASE mlflow OWNER hpt;
