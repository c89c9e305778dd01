#!/bin/bash

# Parameters
#SBATCH --chdir=/work/main
#SBATCH --comment=gyre_run_dir=/work/main
#SBATCH --exclusive
#SBATCH --export=ALL,GYRE_ROOT=/work/main
#SBATCH --job-name=gyre-main
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/work/main/logs/slurm-%j.out
#SBATCH --requeue
#SBATCH --signal=B:USR2@300
#SBATCH --time=72:00:00
#SBATCH --wckey=submitit

# setup
exec bash /work/main/sbatch/gyre.sbatch /work/main/configs/tiny.yaml /work/main

# command
export SUBMITIT_EXECUTOR=slurm
/root/.cache/gyre_slurm/venv-core-7b097052df5db8d8/bin/python -u -m submitit.core._submit /work/main/logs/submitit
