# envfleet/base: the rootfs plus envd and its private dependencies. Built by orchestrator/images/base.py.
ARG ROOTFS
FROM ${ROOTFS}
COPY site /opt/envfleet/site
COPY protos /opt/envfleet/protos
COPY envd /opt/envfleet/envd
COPY envd-bin /opt/envfleet/bin/envd
# Precompile, also for envd's -OO (the sandbox's root filesystem is read-only); add the sandbox user (uid 1000)
# without useradd if need be.
RUN python3 -m compileall -q /opt/envfleet && python3 -OO -m compileall -q /usr/lib/python3.11 /opt/envfleet \
    && if getent passwd 1000 >/dev/null; then :; \
       elif command -v useradd >/dev/null; then useradd -u 1000 -U -M -d /tmp -s /bin/bash sandbox; \
       else echo 'sandbox:x:1000:1000::/tmp:/bin/bash' >> /etc/passwd && echo 'sandbox:x:1000:' >> /etc/group; fi \
    && mkdir -p /workspace /run/envd \
    && chown 1000:1000 /workspace /run/envd
# Fail the build, not the first sandbox, when envd cannot import (a missing wheel, a protobuf version mismatch).
RUN python3 -S -c "import sys; sys.path[:0] = ['/opt/envfleet/site', '/opt/envfleet']; import envd.server"
ENV LANG=C.UTF-8 TZ=UTC
WORKDIR /workspace
LABEL envfleet.envd=1
CMD ["python3", "-S", "-OO", "/opt/envfleet/envd/launch.py"]
