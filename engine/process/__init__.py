"""What an engine process sets up about itself: dying with its parent, and the CPU allocator's behaviour.

Light on purpose (no torch model code): the launcher and the CLI import it in processes that never load a model.
"""
