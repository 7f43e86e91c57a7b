"""The A/B tool: replay one serving trace through two attention backends and compare them.

``python -m dsv4_backend ab`` runs :mod:`~dsv4_backend.tools.ab.cli`. From Python: build a trace
(:func:`~dsv4_backend.tools.ab.trace.build_trace`), two backends
(:func:`~dsv4_backend.tools.ab.backends.make_backend`, or ``DSV4Backend`` / ``ReferenceBackend``
directly), run :func:`~dsv4_backend.tools.ab.runner.run_trace`, then
:func:`~dsv4_backend.tools.ab.report.build_report` / ``write_report``.

Nothing is imported here, so that adding the ``ab`` command to the CLI's parser stays cheap.
"""
