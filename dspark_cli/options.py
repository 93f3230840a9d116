"""The flags several commands share, defined once so that the same thing has the same name, choices,
default and help everywhere (`dspark generate`, `eval`, `calibrate`, `bench`, `report`, `profile`, `serve ...`).

- `--drafter {auto,none,dspark,...}` / `--drafter-path DIR`: `auto` is the default drafter when it was trained
  for the target (else none, said on stderr), `none` decodes autoregressively.
- `--drafter-matmul-dtype` (`--matmul-dtype` is kept as a hidden alias), `--weights`, `--policy` (the names of the
  dspark_core.scheduling registry, plus its aliases) and `--device` / `--dtype`: services.common.flags owns
  them, since the services take them too (and import nothing from the CLI).
- `--temperature`: interactive commands (`generate`, `client generate`) default to INTERACTIVE_TEMPERATURE;
  measurement commands keep their protocol's (eval / calibrate 1.0 as the paper, bench 0 = greedy).
"""

from __future__ import annotations

from dspark_core.scheduling import POLICY_ALIASES, POLICY_NAMES  # noqa: F401 - the CLI's names
from dspark_core.stack import DRAFTER_NAMES, MATMUL_DTYPES  # noqa: F401 - the CLI's names
from services.common.flags import (add_device_args, add_matmul_dtype_arg, add_policy_arg,  # noqa: F401
                                   add_target_arg, add_weights_arg, policy_name)

DRAFTER_CHOICES = ("auto", "none", *DRAFTER_NAMES)
INTERACTIVE_TEMPERATURE = 0.7


def add_drafter_args(p, default: str | None = "auto", path_default: str | None = None,
                     what: str = "drafter to decode with") -> None:
    p.add_argument("--drafter", default=default, choices=DRAFTER_CHOICES,
                   help=f"{what}: a shipped name, none (autoregressive) or auto (the default drafter when it was "
                        "trained for the target, else none) (default %(default)s)")
    p.add_argument("--drafter-path", default=path_default,
                   help="drafter checkpoint directory (DeepSpec format; wins over --drafter)")


def add_temperature_arg(p, default: float = INTERACTIVE_TEMPERATURE, why: str = "") -> None:
    p.add_argument("--temperature", type=float, default=default,
                   help=f"sampling temperature, 0 = greedy (default %(default)s{why})")


def drafter_is_auto(args) -> bool:
    """The drafter was left to `--drafter auto` (no `--drafter-path`)."""
    return getattr(args, "drafter", None) == "auto" and not getattr(args, "drafter_path", None)
