"""The linear method that ships with the core, registered like any plugin's: `plain`, the
weight as loaded and F.linear (plugserve.worker.layers.plain_linear says why it is
not a plugin). By "module:Class" reference, so loading the registry imports no worker code.
"""

from __future__ import annotations

from plugserve import hookimpl


@hookimpl
def register_linear_methods(register):
    register("plain", "plugserve.worker.layers.plain_linear:PlainLinearMethod")
