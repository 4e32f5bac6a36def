# Tandem on CPU: one image for the router, draft_service and target_service (and demo_models),
# used by the `cpu` overlay. GPUs: Dockerfile.cuda (CUDA torch + flash-attn), the `gpu` overlay.
#
#   docker build -t ghcr.io/tandem-serving/tandem:0.1.0 .            (make image)
#
# Every version comes from pyproject.toml; nothing is pinned twice.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- builder: a venv with the pinned dependencies, and the generated gRPC stubs ----------------
FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /app

# Dependencies first: this layer is rebuilt only when pyproject.toml changes. torch goes first and
# exact, from the PyTorch index (PyPI's torch is the multi-GB CUDA build); the rest from PyPI.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && cat /tmp/requirements.txt \
 && pip install --index-url "${TORCH_INDEX_URL}" "$(grep '^torch==' /tmp/requirements.txt)" \
 && pip install -r /tmp/requirements.txt \
 && pip check

# Stubs: the same protoc invocation as `make proto`.
COPY proto/ proto/
RUN mkdir -p tandem/v1 \
 && python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto

COPY common/ common/
COPY engine/ engine/
COPY draft_service/ draft_service/
COPY target_service/ target_service/
COPY router/ router/
COPY demo_models/ demo_models/
# Bytecode now: the root filesystem is read-only at run time.
RUN python -m compileall -q common engine draft_service target_service router demo_models tandem \
 && python -c "import router.__main__, target_service.__main__, draft_service.__main__"

# ---- runtime: the venv and the sources, non-root ---------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tandem
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /app/tandem /app/tandem
COPY --from=builder /app/common /app/common
COPY --from=builder /app/engine /app/engine
COPY --from=builder /app/draft_service /app/draft_service
COPY --from=builder /app/target_service /app/target_service
COPY --from=builder /app/router /app/router
COPY --from=builder /app/demo_models /app/demo_models
# Everything that writes at run time goes to /tmp (an emptyDir in the manifests).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1
WORKDIR /app
# Numeric, so Kubernetes can verify runAsNonRoot.
USER 10001:10001
# router HTTP, router gRPC, target, draft
EXPOSE 8000 50051 50052 50053
LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="Tandem LLM serving: router, draft and target services" \
      org.opencontainers.image.version="0.1.0"
# The manifests set the command: python -m router | target_service | draft_service
CMD ["python", "-m", "router", "--help"]
