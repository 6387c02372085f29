"""EMoE: the emergent experts of a pretrained model's FFNs (Qiu, Huang & Fu, "Unlocking Emergent Modularity in Large
Language Models"), composable with any PEFT adapter.

``moefy(model)`` splits the neurons of chosen FFNs into ``num_experts`` groups by balanced k-means of their keys and
keeps, per token, only the ``top_k`` groups whose mean key scores highest; no parameter is added, and the gate is
recomputed from the current keys, so fine-tuning (or an adapter on the keys) moves it. Train with LoRA or SMEAR on
top as usual; save the partition with :func:`save_emoe` beside the adapter. The tuned adapter also runs on the dense
model (EMoE2LoRA), the fast way to serve.
"""

from .analysis import selection_report
from .clustering import balanced_assignment, balanced_kmeans, random_partition, within_cluster_sum_of_squares
from .gate import EmoeGate
from .moefy import FEED_FORWARD_KINDS, emoe_gates, find_feed_forwards, gate_parameters, moefy, remove_emoe
from .persistence import CONFIG_NAME, PARTITION_NAME, load_emoe, save_emoe


__all__ = [
    "CONFIG_NAME",
    "FEED_FORWARD_KINDS",
    "PARTITION_NAME",
    "EmoeGate",
    "balanced_assignment",
    "balanced_kmeans",
    "emoe_gates",
    "find_feed_forwards",
    "gate_parameters",
    "load_emoe",
    "moefy",
    "random_partition",
    "remove_emoe",
    "save_emoe",
    "selection_report",
    "within_cluster_sum_of_squares",
]
