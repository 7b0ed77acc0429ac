# The pinned Rust toolchain (rust-toolchain.toml), made available without a download. Sourced,
# from the repository root, by every script that runs cargo (.ci/run, scripts/test, scripts/demo,
# the benchmarks, scripts/valgrind) before its first cargo command.
#
# rust-toolchain.toml names an exact release, so that clippy's and rustdoc's warnings (errors in
# CI) are those of one compiler. Where rustup can download, it installs that release itself.
# Where it cannot (this project's machines reach no toolchain server), the release must already be
# installed: a machine whose only toolchain is `stable` still has it when that stable *is* the
# pinned release, but rustup knows it only by the name `stable`, and would try (and fail) to
# download the pinned name. So, when the pinned name is missing and an installed toolchain is
# exactly the pinned release, we give it the pinned name: the entry
# `$RUSTUP_HOME/toolchains/<release>-<host>` pointing at that toolchain's directory, which is what
# `rustup toolchain link` makes (rustup refuses that command for names of releases, hence the
# plain symlink). Nothing is downloaded and no toolchain directory is changed. Any other case
# stops with a message saying what to do. Without rustup, the toolchain file means nothing to
# cargo: the compiler found must then be the pinned release.
#
# RUSTUP_TOOLCHAIN set by the caller (e.g. `RUSTUP_TOOLCHAIN=nightly scripts/test`) overrides the
# pin, as it does for rustup itself: it is used as it is, with a note.

ensure_pinned_toolchain() {
    local pinned
    pinned=$(sed -n 's/^channel *= *"\([^"]*\)".*/\1/p' rust-toolchain.toml)
    if [ -z "$pinned" ]; then
        echo "toolchain: no channel in rust-toolchain.toml" >&2
        return 1
    fi
    if [ -n "${RUSTUP_TOOLCHAIN:-}" ]; then
        echo "toolchain: RUSTUP_TOOLCHAIN=$RUSTUP_TOOLCHAIN overrides the pinned $pinned" >&2
        return 0
    fi
    if ! command -v rustup >/dev/null 2>&1; then
        local found
        found=$(rustc --version 2>/dev/null | cut -d' ' -f2)
        if [ "$found" != "$pinned" ]; then
            echo "toolchain: rust-toolchain.toml pins Rust $pinned, but rustc is ${found:-missing}" \
                "and there is no rustup to select $pinned; install Rust $pinned" >&2
            return 1
        fi
        return 0
    fi
    # Never let rustup download in what follows: a missing toolchain is an error here, not a
    # download attempt (which fails slowly on a machine without access).
    export RUSTUP_AUTO_INSTALL=0
    if [ "$(rustup run "$pinned" rustc --version 2>/dev/null | cut -d' ' -f2)" = "$pinned" ]; then
        return 0
    fi
    local home host name version candidate=""
    home=$(rustup show home)
    host=$(rustup show 2>/dev/null | sed -n 's/^Default host: *//p')
    if [ -z "$host" ]; then
        echo "toolchain: cannot tell rustup's default host" >&2
        return 1
    fi
    # The installed toolchains whose compiler is exactly the pinned release (not a nightly or
    # beta of it: those say 1.95.0-nightly).
    while read -r name _; do
        [ -n "$name" ] || continue
        case "$name" in "$pinned"-*) continue ;; esac
        version=$(rustup run "$name" rustc --version 2>/dev/null | cut -d' ' -f2)
        if [ "$version" = "$pinned" ]; then
            candidate=$name
            break
        fi
    done < <(rustup toolchain list 2>/dev/null)
    local entry="$home/toolchains/$pinned-$host"
    if [ -z "$candidate" ]; then
        echo "toolchain: rust-toolchain.toml pins Rust $pinned, which is not installed, and no" \
            "installed toolchain is that release ($(rustup toolchain list 2>/dev/null | tr '\n' ' '))." \
            "With network access: rustup toolchain install $pinned. Otherwise install Rust" \
            "$pinned some other way, or change the pin (rust-toolchain.toml) in a commit of its own." >&2
        return 1
    fi
    if [ -e "$entry" ] && [ ! -L "$entry" ]; then
        echo "toolchain: $entry exists but does not run; not touching it" >&2
        return 1
    fi
    local target
    target=$(rustup run "$candidate" rustc --print sysroot)
    ln -sfn "$target" "$entry"
    if [ "$(rustup run "$pinned" rustc --version 2>/dev/null | cut -d' ' -f2)" != "$pinned" ]; then
        echo "toolchain: linked $entry -> $target, but rustup still cannot run $pinned" >&2
        return 1
    fi
    echo "toolchain: Rust $pinned is the installed '$candidate'; linked it as $pinned ($entry)" >&2
}
