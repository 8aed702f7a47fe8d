"""The Flow DSL: immutable plans, clear errors, and no way to mix in a DataFrame."""

import pytest

import ackflow
from ackflow.core import ConfigError
from ackflow.sinks import MemorySink
from ackflow.testing import ListSource


def test_a_flow_is_immutable_and_extending_it_makes_a_new_one():
    base = ackflow.Flow(ListSource([]))
    a = base.map(lambda r: r, name="a")
    assert base.steps == () and [s.name for s in a.steps] == ["a"]
    with pytest.raises(AttributeError):
        a.steps = ()  # frozen


def test_step_names_are_unique_and_defaulted():
    flow = ackflow.Flow(ListSource([])).map(lambda r: r).filter(lambda r: True)
    assert [s.name for s in flow.steps] == ["map_1", "filter_2"]
    with pytest.raises(ConfigError, match="used twice"):
        flow.map(lambda r: r, name="map_1")


def test_nothing_after_the_sink_and_only_one_sink():
    done = ackflow.Flow(ListSource([])).to(MemorySink())
    with pytest.raises(ConfigError, match="already ends in sink"):
        done.map(lambda r: r)
    with pytest.raises(ConfigError, match="already ends in a sink"):
        done.to(MemorySink("other"))


def test_a_dataframe_cannot_enter_a_flow_except_as_a_join_side(spark):
    df = spark.createDataFrame([(1,)], "a INT")
    with pytest.raises(ConfigError, match="a DataFrame is not a source"):
        ackflow.Flow(df)
    flow = ackflow.Flow(ListSource([]))
    with pytest.raises(ConfigError, match="a Spark writer cannot ack"):
        flow.to(df)
    with pytest.raises(ConfigError, match="expected a function"):
        flow.map(df)
    assert flow.join(df, "a").steps[0].kind == "Join"  # the one legitimate place


def test_a_flow_has_no_dataframe_methods():
    flow = ackflow.Flow(ListSource([])).to(MemorySink())
    for name in ("collect", "write", "toPandas", "show", "rdd"):
        assert not hasattr(flow, name)


def test_bad_operator_arguments():
    flow = ackflow.Flow(ListSource([]))
    with pytest.raises(ConfigError, match="reserved"):
        flow.with_columns(__af_id="1")
    with pytest.raises(ConfigError, match="one or more column names"):
        flow.group_by()
    with pytest.raises(ConfigError, match="n must be a positive integer"):
        flow.grouped_within(0, 1.0)
    with pytest.raises(ConfigError, match="only one grouped_within"):
        flow.grouped_within(2, 1.0).grouped_within(2, 1.0)
    with pytest.raises(ConfigError, match="no sink"):
        flow.validate()


def test_the_error_sink_needs_a_name_of_its_own(tmp_path):
    """Issue 27 #11: a Parquet main sink and a Parquet error sink (both named "parquet")
    were summed into one rows_written entry: the report said rows were written that
    were not."""
    from ackflow.sinks import ParquetSink

    flow = (
        ackflow.Flow(ListSource([b"{}"]))
        .to(ParquetSink(tmp_path / "out"))
        .on_error(ParquetSink(tmp_path / "dead"))
    )
    with pytest.raises(ConfigError, match=r"\['parquet'\] are used more than once.*error sink"):
        flow.validate()
    (
        ackflow.Flow(ListSource([b"{}"]))
        .to(ParquetSink(tmp_path / "out"))
        .on_error(ParquetSink(tmp_path / "dead", name="dead letters"))
    ).validate()
