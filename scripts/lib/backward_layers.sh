# Sourced by scripts that check the category hooks' backward scopes on a real PyTorch model
# (scripts/bench-categories, scripts/gpu/categories.sh):
#   backward_layers CACHEALLOC_TOOL TRACE_DIR
# prints, one per line and sorted, the decoder layers (`….layers.N` scopes) that the trace's
# first backward phase names: the modules the hooks' pre-hooks (C++ or Python:
# shim/python/cachealloc_backward_scopes.py) put autograd's thread in, layer by layer.
backward_layers() {
    "$1" trace "$2" 2>/dev/null | awk '
        / phase +backward/ { inside = 1; next }
        / phase / { if (inside) exit; next }
        inside && / scope .*\.layers\.[0-9]+$/ { print $NF }' | sort -u || true
}

# backward_gradient_tags CACHEALLOC_TOOL TRACE_DIR
# prints how many blocks the trace's first backward phase tags as gradients (the hooks tag each
# parameter's `.grad` when `backward()` returns, before the phase ends).
backward_gradient_tags() {
    "$1" trace "$2" 2>/dev/null | awk '
        / phase +backward/ { inside = 1; next }
        / phase / { if (inside) exit; next }
        inside && /^.* tag .* GRADIENT$/ { n++ }
        END { print n + 0 }' || true
}
