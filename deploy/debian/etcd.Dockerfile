# etcd from Debian's package, for Docker hosts without an image registry (docker-compose.yml's etcd service
# uses it when KVPOOL_ETCD_IMAGE names it; scripts/compose_check.sh does). BASE: a Debian bookworm image
# (scripts/compose_base_image.sh makes one).
#   docker build -f deploy/debian/etcd.Dockerfile --build-arg BASE=kvpool-base:bookworm -t kvpool-etcd:debian deploy/debian
ARG BASE=debian:bookworm-slim
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends etcd-server etcd-client \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /etcd-data && chown nobody:nogroup /etcd-data
USER nobody
EXPOSE 2379 2380
ENTRYPOINT []
CMD ["etcd"]
