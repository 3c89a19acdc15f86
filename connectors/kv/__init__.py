from connectors.kv.handoff import HandoffState, KVHandoff, KVHandoffError

__all__ = ["HandoffState", "KVHandoff", "KVHandoffError"]
