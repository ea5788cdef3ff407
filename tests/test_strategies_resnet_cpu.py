"""Every strategy on CPU (gloo), launched by its own launcher, against the plain loop at world size 2 on ResNet-20 in
fp32, judged in the matrix tier. Subtle errors need ResNet-20 as well as gpt-tiny (tests/test_strategies_cpu.py): its
BatchNorm amplifies a small change of the initial weights, where gpt-tiny hardly shows one. The cells are launched
once per session (tests/conftest.py: `resnet_fp32`)."""

import pytest

from harness.spec import Status
from tests.test_strategies_cpu import MULTI_PROCESS, TRANSFORMER_ONLY, trains_like_the_plain_loop

pytestmark = [pytest.mark.launch, pytest.mark.matrix]   # every test here reads cells launched for real


@pytest.mark.parametrize("strategy", MULTI_PROCESS)
def test_strategy_at_two_ranks_trains_resnet20_like_the_plain_loop(resnet_fp32, strategy):
    trains_like_the_plain_loop(resnet_fp32, strategy)


@pytest.mark.parametrize("strategy", TRANSFORMER_ONLY)
def test_a_transformer_only_strategy_skips_resnet_with_the_reason(resnet_fp32, strategy):
    skipped = resnet_fp32[strategy]
    assert skipped.status is Status.SKIPPED and "resnet20-cifar has none" in skipped.message
