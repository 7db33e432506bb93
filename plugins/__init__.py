"""Custom operators that llmc graphs carry and that the backends implement.

Each plugin owns its op schema, a slow reference implementation that defines its semantics,
and the kernels (CPU, GPU) that are tested against that reference.
"""
