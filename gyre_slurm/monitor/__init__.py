"""Watching a run from outside it: `gyre status` (a live terminal view) and `gyre report`
(a PNG of the whole run). Both only READ the run dir (status.json, events.jsonl), so they
work from a login node and never block or slow the job.

Modules: `model` (reading the run dir and deriving every figure shown), `view` (the rich
frame), `report` (the matplotlib figure), `slurm` (JOBID -> run dir), `cli`.
"""
