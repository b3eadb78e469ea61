"""The launcher's own calls to its tritonserver: is the model ready, load it, unload it.

Over the server's HTTP port on this host (the admin key in its header): the gRPC port may speak TLS only, with a
certificate for a public name and, with mutual TLS, only to clients holding a certificate the launcher has not.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

ADMIN_HEADER = "lingbot-admin-key"  # opens the restricted APIs (a per-launch secret: docs/security.md)


class ControlError(RuntimeError):
    """The server refused or failed a load or an unload (its words), or could not be reached."""


class ModelControl:
    def __init__(self, http_url: str, admin_key: str) -> None:
        """http_url: HOST:PORT of the server's HTTP endpoint."""
        self.base, self.admin_key = f"http://{http_url}", admin_key

    def is_model_ready(self, model: str) -> bool:
        """False also while the server cannot be reached (starting, stopped)."""
        try:
            with urllib.request.urlopen(f"{self.base}/v2/models/{model}/ready", timeout=5.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def load_model(self, model: str, timeout_s: float) -> None:
        self._post(f"/v2/repository/models/{model}/load", timeout_s)

    def unload_model(self, model: str) -> None:
        self._post(f"/v2/repository/models/{model}/unload", 30.0)

    def _post(self, path: str, timeout_s: float) -> None:
        request = urllib.request.Request(f"{self.base}{path}", data=b"{}", method="POST",
                                         headers={ADMIN_HEADER: self.admin_key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                return
        except urllib.error.HTTPError as exc:
            raise ControlError(_error_text(exc.read())) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ControlError(f"the server could not be reached ({exc})") from None


def _error_text(body: bytes) -> str:
    """Triton's {"error": "..."} body, else the body as it is."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")
