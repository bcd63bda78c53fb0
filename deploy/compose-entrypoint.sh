#!/bin/sh
# The entrypoint of docker-compose.yml's respool containers: `respool "$@"`, once the settings an
# operator gave in the shell or in .env are in place. Compose hands each one over as
# FROM_SHELL_<its name> (docker-compose.yml lists which), empty when it was not given. A given one
# wins over respool.env's, as compose's own `environment:` would; one not given leaves respool.env's
# standing, where a bare `NAME:` entry in `environment:` would unset it.
set -eu
for name in $(env | sed -n 's/^FROM_SHELL_\(RESPOOL_[A-Z0-9_]*\)=.*/\1/p'); do
    eval "value=\${FROM_SHELL_${name}}"
    unset "FROM_SHELL_${name}"
    if [ -n "${value}" ]; then
        export "${name}=${value}"
    fi
done
exec respool "$@"
