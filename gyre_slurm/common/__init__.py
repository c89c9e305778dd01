"""Pieces every package may import, and that import no other package of gyre_slurm but
`errors`: `fsio` (atomic writes to the shared filesystem, whole-line JSONL reading, disk
full), `web` (bearer authentication and the checking of JSON request bodies, shared
by the control channel, the gateway and the embedded engine), `values` (what a
decoded JSON value is: an integer, a number, a finite one, never a bool) and
`fastexit` (a main program's end without the interpreter's teardown)."""
