"""Plug-ins that let serving engines drive torch_kvswap.

Each submodule imports its engine lazily: importing ``torch_kvswap`` or this
package never needs the engine installed.
"""
