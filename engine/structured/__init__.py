"""Structured output (guided decoding) through xgrammar: request parameters, compilation, bitmasks."""
