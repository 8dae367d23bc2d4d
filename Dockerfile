# SageMaker serving image: `docker run IMAGE serve` (or `podman run`). Built by `make image` (ci/image.sh), which
# fills wheelhouse/ on the host first: the build installs only from it and needs no package index.
# Keep the base an argument: any Debian-based image with apt works (debian:bookworm resolves to the local
# debootstrap image on machines without a registry, see ci/image.sh).
ARG BASE_IMAGE=debian:bookworm

# The lean engine's int8 decode kernel (plain C), compiled in a stage of its own so the serving image carries the
# library and not the compiler; at run time it takes the libgomp torch has already loaded.
FROM ${BASE_IMAGE} AS kernel
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends gcc libc6-dev libgomp1 python3 >/dev/null
COPY handler/engine/model/kernels/build.py handler/engine/model/kernels/*.c /src/
RUN LLM_KERNEL_CACHE=/opt/kernels python3 /src/build.py

FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    LLM_KERNEL_CACHE=/opt/kernels \
    LLM_INT8_CACHE=/opt/int8

# Python 3.11 from Debian, in a venv. (libgomp and friends ship inside the torch wheel.)
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && python3 -m venv /opt/venv

WORKDIR /opt/program

# Runtime requirements only, from the host-filled wheelhouse (bind-mounted, so no wheel becomes a layer).
COPY requirements.txt ./
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    pip install --quiet --no-index --find-links /wheelhouse -r requirements.txt

# The embedded default model, assembled now (it changes only with assemble_model.py). A model SageMaker mounts
# at /opt/ml/model takes precedence at run time: the image sets no option.model_id.
COPY handler/__init__.py handler/assemble_model.py handler/
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    TQDM_DISABLE=1 python -m handler.assemble_model --find-links /wheelhouse model_store/smollm2-135m-instruct

COPY --from=kernel /opt/kernels/ /opt/kernels/

# The application last: editing it rebuilds only these layers.
COPY serving.properties ./
COPY handler/ handler/
# LMI's handler API (from djl_python import Input, Output), importable from the working directory as handler is
COPY djl_python/ djl_python/
RUN python -m compileall -q handler djl_python \
    && python -m handler.engine.prepare model_store/smollm2-135m-instruct

EXPOSE 8080
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true
# a WebSocket at /invocations-bidirectional-stream (handler/endpoints/bidirectional.py)
LABEL com.amazonaws.sagemaker.capabilities.bidirectional-streaming=true
ENTRYPOINT ["/opt/venv/bin/python", "-m", "handler"]
CMD ["serve"]
