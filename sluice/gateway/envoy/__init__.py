"""Envoy as Sluice's data plane: the bootstrap template and the process launcher.

`bootstrap` renders the one Envoy configuration (its CLI writes the same file for the chart and
images; `listener` holds the HTTP half: filters, routes, local replies); `process` finds the
binary and runs it. The endpoint picker it talks to over ext_proc lives in
`sluice.gateway.server`.
"""
