# The image every Airflow service in docker-compose.yaml runs: Airflow, the providers, PyTorch and
# the hybridflow package, all installed at build time (nothing is installed when a container starts).
#
#   docker compose build
#
# PyTorch: requirements-torch.txt pins the version. On x86_64 the default package index serves a
# CUDA build (several GB); pass an index that serves the CPU build with
#   docker compose build --build-arg TORCH_INDEX_URL=<index url>
#
# The model server's image (serving.kubernetes.image; KServe custom predictor or Deployment pods), a stage
# of its own because KServe's pins cannot share Airflow's environment:
#   docker build --target serve -t <registry>/hybridflow-serve:<tag> .
# Its pods run ``python -m hybridflow.serving.server ...`` (hybridflow.serving.k8s_manifests).
FROM python:3.11-slim-bookworm AS serve

ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1
RUN useradd --create-home --uid 50000 --gid 0 serve
WORKDIR /opt/hybridflow
COPY requirements-serve.txt requirements-torch.txt ./
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} -r requirements-torch.txt \
 && pip install -r requirements-serve.txt
COPY pyproject.toml README.md ./
COPY include ./include
COPY examples ./examples
RUN pip install --no-deps .
USER serve
EXPOSE 8080
ENTRYPOINT ["python", "-m", "hybridflow.serving.server"]

# The Airflow image (the last stage: what a plain build makes).
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    AIRFLOW_HOME=/opt/airflow \
    HYBRIDFLOW_HOME=/opt/hybridflow/var \
    HYBRIDFLOW_CONFIG_DIR=/opt/hybridflow/config

RUN apt-get update \
 && apt-get install -y --no-install-recommends curl tini \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 50000 --gid 0 airflow

WORKDIR /opt/hybridflow
COPY requirements.txt requirements-torch.txt ./
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} -r requirements-torch.txt \
 && pip install -r requirements.txt

COPY pyproject.toml README.md ./
COPY include ./include
# The example models: importable by name (models.yaml entry points) in every service and gang pod.
COPY examples ./examples
RUN pip install --no-deps .

COPY dags ./dags
COPY plugins ./plugins
COPY config ./config
RUN mkdir -p "$AIRFLOW_HOME" "$HYBRIDFLOW_HOME" && chown -R airflow:0 "$AIRFLOW_HOME" "$HYBRIDFLOW_HOME"

ENV AIRFLOW__CORE__DAGS_FOLDER=/opt/hybridflow/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/hybridflow/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False
USER airflow
ENTRYPOINT ["/usr/bin/tini", "--", "airflow"]
CMD ["version"]
