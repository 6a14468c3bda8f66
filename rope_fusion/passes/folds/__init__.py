"""Data movement next to a rotation that a backend's opaque node takes over: one `Fold` record per kind in
fold_registry.py (a write into a slice, a joined x read from its pieces, a rotation joined after it), plus the
KV-cache write fold that rope_pass.py runs once the groups are committed."""
