# Prometheus from Debian's package, for Docker hosts without an image registry (docker-compose.yml's
# prometheus service uses it when KVPOOL_PROMETHEUS_IMAGE names it; scripts/compose_check.sh does).
# Same entry point and data directory as the upstream image, so the compose command fits both.
#   docker build -f deploy/debian/prometheus.Dockerfile --build-arg BASE=kvpool-base:bookworm -t kvpool-prometheus:debian deploy/debian
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
