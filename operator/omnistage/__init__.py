"""omnistage-operator: runs vllm-omni with a replicated, elastic stage 0 on Kubernetes."""
