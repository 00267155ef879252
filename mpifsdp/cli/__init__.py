"""`python -m mpifsdp inspect|export|plan|pictures`: the command lines, above the library and the
models they name (`--gpt` builds a GPTConfig).

May import anything, mpifsdp.models included; nothing in the library imports it.
"""
