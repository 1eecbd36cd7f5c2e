# flywheel/postgres: Debian's PostgreSQL 15, the package infra/mlflow/server.sh and the tests run,
# for MLflow's backend store in Kubernetes (infra/k8s/mlflow.yaml).
#   docker build -f infra/images/postgres.Dockerfile -t flywheel/postgres:15 infra/images
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 && rm -rf /var/lib/apt/lists/*
COPY postgres-entrypoint.sh /usr/local/bin/
USER postgres
ENV PGDATA=/var/lib/postgresql/data/pgdata
EXPOSE 5432
ENTRYPOINT ["postgres-entrypoint.sh"]
