# Redis for docker-compose.yml where no registry can be reached (the file's default is the official
# redis:7). Debian bookworm's redis-server is 7.0. Built FROM the same local base as the AMPD image:
#   podman build --network host -f deploy/redis.Dockerfile \
#     --build-arg BASE_IMAGE=localhost/debian-py:bookworm -t localhost/ampd-redis:7 deploy
#   AMPD_REDIS_IMAGE=localhost/ampd-redis:7 podman-compose up -d
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
# As the official image's entrypoint does: started without a config file, Redis turns protected
# mode off (it would refuse every peer container; the compose network is the boundary).
RUN printf '%s\n' '#!/bin/sh' \
      'if [ "$1" = redis-server ]; then shift; set -- redis-server "$@" --protected-mode no; fi' \
      'exec "$@"' > /usr/local/bin/redis-entrypoint \
 && chmod 0755 /usr/local/bin/redis-entrypoint
USER redis
EXPOSE 6379
ENTRYPOINT ["/usr/local/bin/redis-entrypoint"]
CMD ["redis-server", "--save", "", "--appendonly", "no"]
