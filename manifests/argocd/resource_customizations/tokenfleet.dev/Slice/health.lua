-- Argo CD health of a tokenfleet Slice (a gang of pods placed, run and restarted together), from its phase and
-- conditions (docs/api.md): Failed (restart budget spent: Stalled) and a gang that lost a member (Degraded) or is
-- being restarted (Restarting) are Degraded; Ready, and a batch Slice that finished (Succeeded), are Healthy;
-- waiting for admission, binding and starting are Progressing.
local hs = {}
local by_type = {}
if obj.status ~= nil and obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    by_type[c.type] = c
  end
end
local function says(c)
  if c == nil then
    return ""
  end
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end

if obj.status == nil or obj.status.observedGeneration == nil
    or (obj.metadata.generation ~= nil and obj.status.observedGeneration ~= obj.metadata.generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local phase = obj.status.phase
if (by_type.Stalled ~= nil and by_type.Stalled.status == "True") or phase == "Failed" then
  hs.status = "Degraded"
  hs.message = says(by_type.Stalled or by_type.Failed)
  return hs
end
if phase == "Degraded" or phase == "Restarting" then
  hs.status = "Degraded"
  hs.message = phase .. ": " .. says(by_type.Ready)
  return hs
end
if by_type.Ready ~= nil and by_type.Ready.status == "True" then
  hs.status = "Healthy"
  hs.message = says(by_type.Ready)
  return hs
end
hs.status = "Progressing"
if phase == "Pending" and by_type.Admitted ~= nil then
  hs.message = "Pending: " .. says(by_type.Admitted)
else
  hs.message = (phase or "Pending") .. ": " .. says(by_type.Ready)
end
return hs
