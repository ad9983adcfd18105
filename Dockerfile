# The orchestrator itself, built offline on top of the envfleet base image: `make image`
# (orchestrator/images/orchestrator_image.py supplies the context: site/ with the unpacked wheels, src/ with the code).
ARG BASE=envfleet/base:latest
FROM ${BASE}
COPY site /opt/envfleet-orchestrator/site
COPY src /opt/envfleet-orchestrator/src
RUN python3 -m compileall -q /opt/envfleet-orchestrator \
    && PYTHONPATH=/opt/envfleet-orchestrator/site:/opt/envfleet-orchestrator/src python3 -c "import orchestrator.cli"
ENV PYTHONPATH=/opt/envfleet-orchestrator/site:/opt/envfleet-orchestrator/src
USER 1000:1000
ENTRYPOINT ["python3", "-m", "orchestrator.cli"]
CMD ["--help"]
