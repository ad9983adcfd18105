# The orchestrator itself, built offline on top of the envfleet base image: `make image` (EXTRA_WHEELS=DIR adds
# plug-in wheels). orchestrator/images/orchestrator_image.py supplies the context: site/ (dependencies, unpacked
# wheels), app/ (the envfleet wheel, unpacked with its .dist-info: entry points and version) and plugins/.
# How to run it next to the engine: deploy/ (run.sh, compose.yaml).
ARG BASE=envfleet/base:latest
FROM ${BASE}
USER 0:0
# dependencies first: they change less often than envfleet
COPY site /opt/envfleet-orchestrator/site
COPY --chown=1000:1000 cache /opt/envfleet-orchestrator/cache
COPY plugins /opt/envfleet-orchestrator/plugins
COPY app /opt/envfleet-orchestrator/app
ENV PYTHONPATH=/opt/envfleet-orchestrator/app:/opt/envfleet-orchestrator/plugins:/opt/envfleet-orchestrator/site \
    PYTHONUNBUFFERED=1 \
    ENVFLEET_DATA_DIR=/var/lib/envfleet \
    ENVFLEET_CACHE=/opt/envfleet-orchestrator/cache
# The console script (the wheel's entry point) as a wrapper; the image cache (ENVFLEET_CACHE: envd's wheels, build
# logs, locks) and the data dir owned by the server's user (a fresh named volume mounted there inherits its owner).
# The last two commands check the install: version and plug-ins.
RUN python3 -m compileall -q /opt/envfleet-orchestrator \
    && printf '#!/bin/sh\nexec python3 -m orchestrator.cli "$@"\n' > /usr/local/bin/envfleet \
    && chmod 0755 /usr/local/bin/envfleet \
    && install -d -o 1000 -g 1000 -m 0750 /var/lib/envfleet \
    && envfleet --version \
    && envfleet envs list
USER 1000:1000
WORKDIR /var/lib/envfleet
EXPOSE 50051
# grpc.health.v1 where the server says it listens (serving.json in its data directory; else ENVFLEET_PORT, default
# 50051): SERVING only while the server runs and the engine answers. With TLS the probe trusts ENVFLEET_HEALTH_TLS_CA,
# else the server's certificate; for mTLS it presents ENVFLEET_HEALTH_TLS_CERT and ENVFLEET_HEALTH_TLS_KEY
# (orchestrator/cli/healthcheck.py)
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-m", "orchestrator.cli.healthcheck"]
ENTRYPOINT ["envfleet"]
CMD ["--help"]
