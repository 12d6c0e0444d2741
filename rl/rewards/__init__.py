"""meshrl.rl.rewards: host-side reward functions `(completion, example) -> float in [0, 1]`.

`compose("answer:1.0,format:0.1")` builds the weighted reward of cfg.rl.rewards; `score_batch`
scores a batch without ever raising. Names: see `REWARDS`.
"""

from meshrl.rl.rewards.compose import (REWARDS, VERIFIERS, WeightedReward, answer_reward, compose,
                                       parse_weights, score_batch)
from meshrl.rl.rewards.countdown import check_expression, countdown_reward, expression_value
from meshrl.rl.rewards.shaping import overlong_penalty
from meshrl.rl.rewards.verifiers import (exact_match, extract_answer, format_reward, last_number,
                                         numeric_match, tagged_format)
