"""Pieces every package may import, and that import no other package of gyre_slurm but
`errors`: `fsio` (atomic writes to the shared filesystem, whole-line JSONL reading, disk
full) and `web` (bearer authentication and the checking of JSON request bodies, shared
by the control channel, the gateway and the embedded engine)."""
