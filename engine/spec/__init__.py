"""Speculative decoding: configuration, draft proposers, verification and rejection sampling."""
