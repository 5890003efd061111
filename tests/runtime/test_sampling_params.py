"""SamplingParams: every bad value is refused at construction with an error naming it."""
import pytest

from engine.core.errors import EngineError
from engine.runtime import SamplingParams


@pytest.mark.parametrize("kwargs, named", [
    (dict(temperature=-0.1), "temperature -0.1"),
    (dict(top_p=0.0), "top_p 0.0"),
    (dict(top_p=1.5), "top_p 1.5"),
    (dict(top_k=-1), "top_k -1"),
    (dict(top_k=2.5), "top_k 2.5"),
    (dict(min_p=1.1), "min_p 1.1"),
    (dict(min_p=-0.1), "min_p -0.1"),
    (dict(max_tokens=0), "max_tokens 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty 0.0"),
    (dict(presence_penalty=2.5), "presence_penalty 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty -3"),
    (dict(stop=("",)), "stop string ''"),
    (dict(logprobs=21), "logprobs 21"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens 5"),
    (dict(seed="x"), "seed 'x'"),
])
def test_invalid_values_name_the_value(kwargs, named):
    with pytest.raises(EngineError) as e:
        SamplingParams(**kwargs)
    assert named in str(e.value)
    assert e.value.exit_code == 2


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 6])
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6)
    assert p.max_stop_len == 3
    assert not p.greedy and SamplingParams(temperature=0).greedy
    hash(p)  # frozen and hashable
