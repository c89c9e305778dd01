"""Named configs shipped with the package (`gyre_slurm/sim/presets/NAME.yaml`)."""

from __future__ import annotations

from pathlib import Path

from gyre_slurm.errors import ConfigError

PRESET_DIR = Path(__file__).resolve().parent.parent / "sim" / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    return path


def resolve(source: str) -> Path:
    """A config argument is a file path or, failing that, a preset name. A pipe
    (`gyre run <(make-config)`) or another file that is not regular is read as it is."""
    path = Path(source)
    if path.is_dir():
        raise ConfigError(f"{source} is a directory; give a config file (YAML) or a "
                          f"preset name")
    if path.exists():
        return path
    if path.suffix in (".yaml", ".yml") or "/" in source:
        raise ConfigError(f"config file {source} does not exist")
    return preset_path(source)
