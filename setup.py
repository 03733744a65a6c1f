"""The compiled parts of slotbridge; everything else is in pyproject.toml.

Four C extensions for the hot path: ``services.bridge.decode._tuples`` reads pgoutput
TupleData (the decoder), ``services.bridge.decode._runs`` reads whole regular transactions
off the replication stream (the socket loop), ``services.bridge.records._rowjson`` writes
the default record format's rows and keys (the event builder) and
``services.bridge.assemble._spoolread`` splits spool files into their records. All are
optional: where no C compiler is at hand the build goes on without them and the bridge does
the same in Python, only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"services.bridge.{module}",
            [f"services/bridge/{module.replace('.', '/')}.c"],
            # _rowjson reads TupleData in place, as _tuples does (decode/_tupledata.h).
            include_dirs=["services/bridge/decode"],
            depends=["services/bridge/decode/_tupledata.h", "services/bridge/records/_hmac.h"],
            optional=True,
            extra_compile_args=["-O2", "-Wall"],
        )
        for module in ("decode._tuples", "decode._runs", "records._rowjson", "assemble._spoolread")
    ]
)
