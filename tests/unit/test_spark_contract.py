"""The consumer's parse schema, derived from the record contract, is the one it needs."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field
from pyspark.sql import SparkSession
from pyspark.sql.types import IntegerType, LongType, StructField, StructType

from services.contract.records import ChangeValue
from spark_consumers.contract import spark_schema
from spark_consumers.parse import ENVELOPE

# What parse.py reads change records with (written by hand before it was derived).
_NEEDED = (
    "before variant, after variant, "
    "source struct<schema:string,table:string,txId:bigint,lsn:bigint,commit_lsn:bigint,"
    "ts_ms:bigint,snapshot:string,schema_version:int>, op string, ts_ms bigint, "
    "transaction struct<id:string,total_order:bigint,data_collection_order:bigint>, "
    "json_nulls struct<before:array<string>,after:array<string>>"
)


@pytest.mark.spark
def test_envelope_is_what_parse_needs(spark: SparkSession) -> None:
    assert StructType.fromDDL(_NEEDED) == ENVELOPE


def test_a_field_the_contract_lacks_is_refused() -> None:
    with pytest.raises(KeyError, match=r"source\.xmin"):
        spark_schema(ChangeValue, only={"source": ("lsn", "xmin")})


class _Counts(BaseModel):
    small: Annotated[int, Field(ge=1, le=2**31 - 1)]
    unbounded: int
    half_bounded: Annotated[int, Field(le=10)]


def test_integers_are_int_only_when_the_contract_bounds_them_to_32_bits() -> None:
    assert spark_schema(_Counts) == StructType(
        [
            StructField("small", IntegerType()),
            StructField("unbounded", LongType()),
            StructField("half_bounded", LongType()),
        ]
    )
