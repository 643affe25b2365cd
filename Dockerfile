# syntax=docker/dockerfile:1.7
# Two images from one file, both carrying the same regroup wheel:
#   docker build --target controller -t regroup-controller:0.1.0 .
#   docker build --target trainer    -t regroup-trainer:0.1.0 .
# The controller image is slim Python without torch; the trainer image is a CUDA PyTorch
# base with regroup installed next to torch: workers launch with regroup-run (torchrun
# with in-place re-forms), and plain torchrun still finds --rdzv-backend=etcd-v3.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
ARG TORCH_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

# ---- wheel: build regroup once ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ARG PIP_VERSION=25.1.1
WORKDIR /src
RUN python -m pip install --no-cache-dir "pip==${PIP_VERSION}"
COPY pyproject.toml README.md ./
COPY regroup ./regroup
COPY controller ./controller
COPY rendezvous ./rendezvous
COPY trainer ./trainer
COPY elastic ./elastic
COPY demo ./demo
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- controller: slim, non-root, no torch --------------------------------------------
FROM ${PYTHON_IMAGE} AS controller
ARG REGROUP_VERSION=0.1.0
LABEL org.opencontainers.image.title="regroup-controller" \
      org.opencontainers.image.description="Elastic PyTorch re-forming controller" \
      org.opencontainers.image.version="${REGROUP_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/regroup/bin:${PATH}
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    python -m venv /opt/regroup \
    && /opt/regroup/bin/pip install --no-cache-dir /wheels/regroup-*.whl \
    && ! /opt/regroup/bin/python -c "import torch" 2>/dev/null
# 65532 is the conventional "nonroot" uid; the Deployment's securityContext requires it.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["regroup"]
CMD ["controller"]

# ---- trainer: CUDA PyTorch base + regroup + topology entrypoint ------------------------
FROM ${TORCH_IMAGE} AS trainer
ARG REGROUP_VERSION=0.1.0
LABEL org.opencontainers.image.title="regroup-trainer" \
      org.opencontainers.image.description="Elastic PyTorch worker with the regroup etcd-v3 rendezvous" \
      org.opencontainers.image.version="${REGROUP_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid 65532 has no passwd entry: USER keeps getpass.getuser() (torch's compile cache)
# from looking one up; caches go to /tmp, the one writable path in a restricted pod.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    USER=regroup
# The base install only: torch comes from the base image and must stay the CUDA build.
# The build fails unless the etcd-v3 backend is registered and the workers' launcher,
# regroup-run, is installed, on PATH and starts against the base image's torch.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir /wheels/regroup-*.whl \
    && python -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'etcd-v3' for e in m.entry_points(group='torchrun.handlers')) else 'etcd-v3 rendezvous backend not registered')" \
    && python -c "import importlib.metadata as m, shutil, sys; sys.exit(0 if any(e.name == 'regroup-run' for e in m.entry_points(group='console_scripts')) and shutil.which('regroup-run') else 'regroup-run launcher not installed')" \
    && regroup-run --help > /dev/null
COPY --chmod=0755 deploy/topology/topology.py /opt/regroup/bin/regroup-topology
COPY --chmod=0755 deploy/topology/entrypoint.sh /opt/regroup/bin/regroup-entrypoint
USER 65532:65532
WORKDIR /workspace
ENTRYPOINT ["/opt/regroup/bin/regroup-entrypoint"]
CMD ["regroup", "smoke"]
