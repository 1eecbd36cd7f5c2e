# flywheel/gpu: the same, with CUDA vLLM, for the training and serving GPUs (not built or run by
# this repository's CI, which has no GPU): scripts/setup.sh with FLYWHEEL_TARGET=gpu. The CUDA
# libraries come with the torch and vLLM wheels, the driver from the node; the Python is the CPU
# image's, as Ray requires of every node of a cluster.
#   docker build -f infra/images/gpu.Dockerfile -t flywheel/gpu:0.1 .
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends curl git libnuma1 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/flywheel
COPY . .
RUN FLYWHEEL_TARGET=gpu FLYWHEEL_VENV=/opt/venv bash scripts/setup.sh
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv
CMD ["loop", "--help"]
