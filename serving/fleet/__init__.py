"""The fleet layer: deployment profiles (measured costs and acceptance, ``profile``) and the SimPy
model of a deployment behind ``simulate`` (``simulator``, ``cli_simulate``). No models run here."""
