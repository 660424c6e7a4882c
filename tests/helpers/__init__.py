"""Shared test helpers: the HF oracle and prompt sets, P/D worker clusters, fake workers behind a real router, a live `kvflow serve`, tensor- and pipeline-parallel engines."""
