from gyre_slurm.cli import main
from gyre_slurm.common.fastexit import exit_now

exit_now(main())
