# Multi-stage build of the one `paceline` binary.
#
# The dependencies are built in a layer of their own, from the manifests and
# Cargo.lock only, so that a change to paceline's sources rebuilds paceline's
# crates and not every dependency.
FROM rust:1-bookworm AS build
WORKDIR /src

# 1. The manifests, and a stub for every target they declare or cargo finds by
#    convention: each crate's src/lib.rs, the binary's src/main.rs, the
#    paceline crate's tests/cli.rs and the tests crate's declared
#    tests/integration/main.rs (a declared target whose file is missing stops
#    cargo before it builds anything). No crate has benches or a build script.
COPY Cargo.toml Cargo.lock ./
COPY shared/Cargo.toml shared/
COPY worker/Cargo.toml worker/
COPY api/Cargo.toml api/
COPY mock-provider/Cargo.toml mock-provider/
COPY paceline/Cargo.toml paceline/
COPY tests/Cargo.toml tests/
RUN for crate in shared worker api mock-provider tests; do \
        mkdir -p $crate/src && touch $crate/src/lib.rs; \
    done \
    && mkdir -p paceline/src paceline/tests tests/tests/integration \
    && echo 'fn main() {}' > paceline/src/main.rs \
    && touch paceline/tests/cli.rs tests/tests/integration/main.rs \
    && cargo build --release --locked -p paceline

# 2. The sources. COPY keeps their modification times, which can be older than
#    the stubs' build: touch them so cargo rebuilds paceline's own crates.
COPY . .
RUN find shared worker api mock-provider paceline tests -name '*.rs' -exec touch {} + \
    && cargo build --release --locked -p paceline

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
# Not root: paceline needs no privilege (its ports are above 1024).
RUN useradd --system --create-home --home-dir /home/paceline --uid 10001 paceline
COPY --from=build /src/target/release/paceline /usr/local/bin/paceline
USER paceline
WORKDIR /home/paceline
ENTRYPOINT ["paceline"]
