"""The compiled parts of slotbridge; everything else is in pyproject.toml.

Three C extensions for the hot path: ``services.bridge._tuples`` reads pgoutput TupleData
(the decoder), ``services.bridge._rowjson`` writes the default record format's rows and
keys (the event builder) and ``services.bridge._spoolread`` splits spool files into their
records. All are optional: where no C compiler is at hand the build goes on without them
and the bridge does the same in Python, only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"services.bridge.{name}",
            [f"services/bridge/{name}.c"],
            depends=["services/bridge/_tupledata.h", "services/bridge/_hmac.h"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        )
        for name in ("_tuples", "_rowjson", "_spoolread")
    ]
)
