"""What an engine process sets up about itself: dying with its parent, the CPU allocator's behaviour, OpenMP's spin;
and, before a CPU worker starts, its memory budget and the config check (`python -m engine.process.preflight`).

Light on purpose (no torch model code): the launcher and the CLI import it in processes that never load a model.
"""
