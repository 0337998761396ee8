"""Tracing, trace-context propagation and Prometheus metrics shared by every service.

Import the submodules directly (`moemesh.shared.telemetry.tracing`, `.metrics`);
this package stays empty so that `moemesh trace export` does not pay for the SDK import.
"""
