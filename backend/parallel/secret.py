"""The launch's group secret: the launcher puts it in the server's environment (the same on every host, MPI
shares rank 0's), and every instance prefixes its store keys with it (torch-free, for the launcher)."""
from __future__ import annotations

import os

from ..api.errors import ConfigError

SECRET_VARIABLE = "LINGBOT_GROUP_SECRET"


def group_secret() -> str:
    """This launch's secret, from the environment."""
    secret = os.environ.get(SECRET_VARIABLE, "")
    if not secret:
        raise ConfigError(f"{SECRET_VARIABLE} is not set: start tritonserver with `python -m backend.launch`, or "
                          "set it to the same random value for every server of the group")
    return secret
