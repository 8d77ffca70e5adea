"""Speculative decoding: the EAGLE-3 draft head, drafting (a chain or a tree), verification
and acceptance, and the controller that turns speculation off and on."""
