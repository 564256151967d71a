-- Argo CD health of a tokenfleet SliceQueue: Healthy once the gang scheduler uses its spec (Ready), Degraded when
-- it cannot (Stalled, reason QueueInvalid: its Slices wait until the spec is fixed), Progressing before the
-- scheduler has seen the latest spec.
local hs = {}
local by_type = {}
if obj.status ~= nil and obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    by_type[c.type] = c
  end
end
if obj.status == nil or obj.status.observedGeneration == nil
    or (obj.metadata.generation ~= nil and obj.status.observedGeneration ~= obj.metadata.generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the gang scheduler to observe the latest spec"
  return hs
end
if by_type.Stalled ~= nil and by_type.Stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = by_type.Stalled.reason .. ": " .. (by_type.Stalled.message or "")
  return hs
end
if by_type.Ready ~= nil and by_type.Ready.status == "True" then
  hs.status = "Healthy"
  hs.message = by_type.Ready.reason .. ": " .. (by_type.Ready.message or "")
  return hs
end
hs.status = "Progressing"
hs.message = "Waiting for the gang scheduler"
return hs
