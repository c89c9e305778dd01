from gyre_slurm.cli import main

raise SystemExit(main())
